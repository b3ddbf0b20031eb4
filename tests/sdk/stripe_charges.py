"""Charges made with the official Stripe Python SDK, through idem's gateway.

Run by tests/tests/stripe_sdk.rs, which starts the gateway in front of an
upstream that counts its charges. One scenario per call; the result is one
JSON object on stdout: what the SDK returned or raised, and how long the
call took.

    python3 stripe_charges.py BASE_URL SCENARIO KEY RETRIES TIMEOUT [DESCRIPTION] [AMOUNT]
"""

import json
import sys
import threading
import time

import stripe


def client(base, retries, timeout):
    return stripe.StripeClient(
        "sk_test_idem",
        base_addresses={"api": base},
        max_network_retries=retries,
        http_client=stripe.RequestsClient(timeout=timeout),
    )


def charge(sdk, key, description, amount):
    """One charge: what the SDK returned, or the error it raised."""
    started = time.monotonic()
    try:
        made = sdk.v1.charges.create(
            params={"amount": amount, "currency": "usd", "description": description},
            options={"idempotency_key": key},
        )
        outcome = {"id": made.id, "amount": made.amount}
    except stripe.StripeError as error:
        headers = error.headers or {}
        outcome = {
            "error": type(error).__name__,
            "status": error.http_status,
            "code": error.error.code if error.error else None,
            "message": error.user_message,
            "retry_after": headers.get("retry-after"),
            "should_retry": headers.get("stripe-should-retry"),
        }
    outcome["seconds"] = round(time.monotonic() - started, 3)
    return outcome


def main():
    base, scenario, key, retries, timeout = sys.argv[1:6]
    description = sys.argv[6] if len(sys.argv) > 6 else "plain"
    amount = int(sys.argv[7]) if len(sys.argv) > 7 else 100
    sdk = client(base, int(retries), float(timeout))
    if scenario == "one":
        result = charge(sdk, key, description, amount)
    elif scenario == "together":
        # Two callers send the same charge at once, each with its own SDK
        # client and the same key.
        results = [None, None]

        def run(i):
            results[i] = charge(client(base, int(retries), float(timeout)), key, description, amount)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        result = {"both": results}
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
