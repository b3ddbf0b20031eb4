//! The fingerprint equivalence vectors of the contract.

use http::Request;
use idem_layer::fingerprint::fingerprint;

#[test]
fn fingerprint_vectors() {
    let mut checked = 0;
    for line in include_str!("fixtures/fingerprint-equivalence.jsonl")
        .lines()
        .filter(|l| !l.is_empty())
    {
        let case: serde_json::Value = serde_json::from_str(line).expect("json");
        let content_type = case["content_type"].as_str().expect("content_type");
        let print = |body: &str| {
            let (parts, ()) = Request::post("/orders")
                .header("content-type", content_type)
                .body(())
                .expect("request")
                .into_parts();
            fingerprint(
                "POST /orders",
                &parts,
                &[http::header::CONTENT_TYPE],
                body.as_bytes(),
            )
        };
        let a = print(case["body_a"].as_str().expect("body_a"));
        let b = print(case["body_b"].as_str().expect("body_b"));
        let same = case["same_fingerprint"]
            .as_bool()
            .expect("same_fingerprint");
        assert_eq!(a == b, same, "{}", case["note"]);
        checked += 1;
    }
    assert!(checked >= 10);
}

#[test]
fn operation_and_headers_are_part_of_the_fingerprint() {
    let parts = |ct: &str| {
        Request::post("/orders")
            .header("content-type", ct)
            .body(())
            .expect("request")
            .into_parts()
            .0
    };
    let headers = [http::header::CONTENT_TYPE];
    let base = fingerprint("POST /orders", &parts("application/json"), &headers, b"{}");
    assert_ne!(
        base,
        fingerprint("POST /refunds", &parts("application/json"), &headers, b"{}")
    );
    assert_ne!(
        base,
        fingerprint("POST /orders", &parts("text/plain"), &headers, b"{}")
    );
    assert_eq!(
        base,
        fingerprint(
            "POST /orders",
            &parts("application/json"),
            &headers,
            b" {} "
        )
    );
}
