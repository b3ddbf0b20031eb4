//! The fingerprint equivalence vectors of the contract.

use http::Request;
use idem_layer::fingerprint::{FingerprintFormat, fingerprint};

/// Both formats, the default first.
const FORMATS: [FingerprintFormat; 2] = [FingerprintFormat::Sha256, FingerprintFormat::Blake3];

/// The fingerprint of `POST /orders` with this content type and body.
fn order_fingerprint(
    format: FingerprintFormat,
    content_type: &str,
    body: &str,
) -> idem_core::Fingerprint {
    let (parts, ()) = Request::post("/orders")
        .header("content-type", content_type)
        .body(())
        .expect("request")
        .into_parts();
    format.fingerprint(
        "POST /orders",
        &parts,
        &[http::header::CONTENT_TYPE],
        body.as_bytes(),
    )
}

/// Stored fingerprints must not change from one version to the next: a
/// retry would answer 422 instead of its replay. The values were computed
/// outside Rust (Python's `hashlib.sha256` and the `blake3` package) over
/// the documented layout: the format's label, then each part as a
/// big-endian u64 length and its bytes (operation, path, query, header
/// name, value count, value), then `raw` and the body.
#[test]
fn fingerprints_are_pinned() {
    let hex = |format| order_fingerprint(format, "text/plain", "amount=100").to_hex();
    assert_eq!(
        hex(FingerprintFormat::Sha256),
        "c92c5988619a9f22e63f2701a64266b21c0d4745c18c2a66fc9ab6e0de06ae57"
    );
    assert_eq!(
        hex(FingerprintFormat::Blake3),
        "b75cf979450914c8e2206b457d57f4cec10eebeda268c89075583558c25c6d85"
    );
    assert_eq!(
        order_fingerprint(FingerprintFormat::default(), "text/plain", "amount=100"),
        fingerprint(
            "POST /orders",
            &Request::post("/orders")
                .header("content-type", "text/plain")
                .body(())
                .expect("request")
                .into_parts()
                .0,
            &[http::header::CONTENT_TYPE],
            b"amount=100"
        ),
        "the default format is SHA-256"
    );
}

#[test]
fn fingerprint_vectors() {
    for format in FORMATS {
        fingerprint_vectors_in(format);
    }
}

fn fingerprint_vectors_in(format: FingerprintFormat) {
    let mut checked = 0;
    for line in include_str!("fixtures/fingerprint-equivalence.jsonl")
        .lines()
        .filter(|l| !l.is_empty())
    {
        let case: serde_json::Value = serde_json::from_str(line).expect("json");
        let content_type = case["content_type"].as_str().expect("content_type");
        let print = |body: &str| order_fingerprint(format, content_type, body);
        let a = print(case["body_a"].as_str().expect("body_a"));
        let b = print(case["body_b"].as_str().expect("body_b"));
        let same = case["same_fingerprint"]
            .as_bool()
            .expect("same_fingerprint");
        assert_eq!(a == b, same, "{format:?}: {}", case["note"]);
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

mod canonical_equivalence {
    use http::Request;
    use idem_layer::fingerprint::{canonical_json, fingerprint};
    use proptest::prelude::*;

    fn json_fingerprint(body: &[u8]) -> idem_core::Fingerprint {
        let (parts, ()) = Request::post("/x")
            .header("content-type", "application/json")
            .body(())
            .expect("request")
            .into_parts();
        fingerprint("POST /x", &parts, &[], body)
    }

    /// `m × 10^e` as a plain decimal (`-12.34`, `0.001234`, `1234000`),
    /// with `zeros` trailing zeros after a decimal point.
    fn decimal(m: i64, e: i32, zeros: usize) -> String {
        if m == 0 {
            return if zeros > 0 {
                format!("0.{}", "0".repeat(zeros))
            } else {
                "0".to_owned()
            };
        }
        let sign = if m < 0 { "-" } else { "" };
        let digits = m.unsigned_abs().to_string();
        let pad = "0".repeat(zeros);
        if e >= 0 {
            let point = if zeros > 0 { "." } else { "" };
            return format!("{sign}{digits}{}{point}{pad}", "0".repeat(e as usize));
        }
        let shift = e.unsigned_abs() as usize;
        if digits.len() > shift {
            let (int, frac) = digits.split_at(digits.len() - shift);
            format!("{sign}{int}.{frac}{pad}")
        } else {
            format!("{sign}0.{}{digits}{pad}", "0".repeat(shift - digits.len()))
        }
    }

    /// The exact value of `m × 10^e`: its digits without trailing zeros
    /// and the exponent that goes with them (zero has one value).
    fn value_of((m, e): (i64, i32)) -> (i128, i32) {
        if m == 0 {
            return (0, 0);
        }
        let (mut m, mut e) = (i128::from(m), e);
        while m % 10 == 0 {
            m /= 10;
            e += 1;
        }
        (m, e)
    }

    fn value() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            // Integers a double holds exactly: RFC 8785 and exact values
            // agree on them (beyond, see `numbers_are_exact`).
            (-(1i64 << 53)..=(1i64 << 53)).prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            "[a-zé\u{1F600}\u{E000}\"\\\\]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(serde_json::Value::Array),
                prop::collection::btree_map("[a-zA-Z\u{E000}\u{1F600}é]{0,4}", inner, 0..5)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// A body and its RFC 8785 form (from the canonicalizer crate) have
        /// the same fingerprint.
        #[test]
        fn canonical_text_has_the_same_fingerprint(value in value(), pretty in any::<bool>()) {
            let text = if pretty {
                serde_json::to_vec_pretty(&value).expect("serialize")
            } else {
                serde_json::to_vec(&value).expect("serialize")
            };
            let canonical = canonical_json(&text).expect("canonical");
            prop_assert_eq!(json_fingerprint(&text), json_fingerprint(&canonical));
        }

        /// Two values with different RFC 8785 forms have different
        /// fingerprints, and equal forms equal fingerprints.
        #[test]
        fn fingerprints_agree_with_canonical_text(a in value(), b in value()) {
            let a = serde_json::to_vec(&a).expect("serialize");
            let b = serde_json::to_vec(&b).expect("serialize");
            let same_text = canonical_json(&a) == canonical_json(&b);
            prop_assert_eq!(same_text, json_fingerprint(&a) == json_fingerprint(&b));
        }

        /// Numbers count by exact value, however many digits: two
        /// different integers never share a fingerprint (RFC 8785 would
        /// round both to one double beyond 2^53), and one value in other
        /// spellings always does.
        #[test]
        fn numbers_are_exact(a in any::<i128>(), b in any::<i128>(), zeros in 0usize..30) {
            let body = |n: &str| format!("{{\"amount\":{n}}}").into_bytes();
            let (fa, fb) = (json_fingerprint(&body(&a.to_string())), json_fingerprint(&body(&b.to_string())));
            prop_assert_eq!(a == b, fa == fb);
            let padded = format!("{a}.0{}", "0".repeat(zeros));
            let shifted = format!("{a}{}e-{zeros}", "0".repeat(zeros));
            prop_assert_eq!(json_fingerprint(&body(&padded)), fa);
            prop_assert_eq!(json_fingerprint(&body(&shifted)), fa);
        }

        /// Decimal amounts count by exact value too: `m × 10^e` spelled
        /// as a decimal, with trailing zeros, or with an exponent is one
        /// payload; two amounts of different value (`12.30` and `12.31`,
        /// or digits beyond a double's) are never one.
        #[test]
        fn decimals_are_exact(
            a in (any::<i64>(), -25i32..25),
            b in (any::<i64>(), -25i32..25),
            zeros in 0usize..5,
        ) {
            let body = |n: &str| format!("{{\"amount\":{n}}}").into_bytes();
            let fingerprint = |(m, e): (i64, i32)| json_fingerprint(&body(&decimal(m, e, 0)));
            for (m, e) in [a, b] {
                let first = fingerprint((m, e));
                prop_assert_eq!(json_fingerprint(&body(&decimal(m, e, zeros))), first);
                prop_assert_eq!(json_fingerprint(&body(&format!("{m}e{e}"))), first);
                if m != 0 {
                    prop_assert_eq!(json_fingerprint(&body(&format!("{m}0E{}", e - 1))), first);
                }
                if m < i64::MAX {
                    prop_assert_ne!(fingerprint((m + 1, e)), first);
                }
            }
            prop_assert_eq!(value_of(a) == value_of(b), fingerprint(a) == fingerprint(b));
        }

        /// Member order never matters, at any depth.
        #[test]
        fn member_order_does_not_matter(
            members in prop::collection::btree_map("[a-z\u{E000}\u{1F600}]{1,4}", value(), 1..8)
                .prop_flat_map(|m| Just(m.into_iter().collect::<Vec<_>>()).prop_shuffle())
        ) {
            let text = |members: &[(String, serde_json::Value)]| {
                let parts: Vec<String> = members
                    .iter()
                    .map(|(k, v)| format!("{}:{}", serde_json::to_string(k).expect("key"), v))
                    .collect();
                format!("{{{}}}", parts.join(","))
            };
            let mut sorted = members.clone();
            sorted.sort_by(|a, b| a.0.cmp(&b.0));
            prop_assert_eq!(json_fingerprint(text(&members).as_bytes()), json_fingerprint(text(&sorted).as_bytes()));
        }

        /// Arbitrary bytes claiming JSON never panic.
        #[test]
        fn arbitrary_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = json_fingerprint(&body);
        }
    }

    #[test]
    fn repeated_keys_are_raw_bytes() {
        // RFC 8785 has no form for a repeated key: such a body is hashed as
        // raw bytes, so it differs from its de-duplicated form.
        assert_ne!(
            json_fingerprint(br#"{"a":1,"a":1}"#),
            json_fingerprint(br#"{"a":1}"#)
        );
        assert_ne!(
            json_fingerprint(br#"{"b":0,"a":1,"a":1}"#),
            json_fingerprint(br#"{"b":0,"a":1}"#)
        );
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+1F600 (surrogates D83D..) sorts before U+E000 in UTF-16, after it in UTF-8.
        let a = "{\"\u{E000}\":1,\"\u{1F600}\":2}";
        let b = "{\"\u{1F600}\":2,\"\u{E000}\":1}";
        assert_eq!(
            json_fingerprint(a.as_bytes()),
            json_fingerprint(b.as_bytes())
        );
        let canonical = canonical_json(a.as_bytes()).expect("canonical");
        assert!(
            std::str::from_utf8(&canonical)
                .expect("utf8")
                .starts_with("{\"\u{1F600}\"")
        );
    }
}

/// Fingerprints of bodies whose numbers a double holds as written are the
/// ones the layer computed before numbers were made exact (captured from
/// that version): records made before an upgrade still match their
/// retries. Only numbers with more digits than a double keeps changed.
#[test]
fn fingerprints_of_ordinary_numbers_are_unchanged() {
    let print = |body: &str| {
        order_fingerprint(FingerprintFormat::Sha256, "application/json", body).to_hex()
    };
    for (body, before) in [
        (
            r#"{"amount":100,"currency":"eur","items":[1,2,3]}"#,
            "e0e1b06d3e9af1339e749ac94cab1db163effe8dc77856555c92bf6ec2edee5c",
        ),
        (
            r#"{"a":12.34,"b":-0.5,"c":1e21,"d":0.1,"e":-0}"#,
            "8e73f75fb0b363b08fd82277bb5338c706f30fe697a8173dabc103796858dea6",
        ),
        (
            r#"[1.5e300,2.5E-7,0.000001,1234567.125]"#,
            "c533c177232ac38f238f494bfebcddb5d73e434ae7ef6e40fcd56a8a3a9c50c6",
        ),
    ] {
        assert_eq!(print(body), before, "{body}");
    }
}

#[test]
fn json_content_types_are_recognized_by_their_essence() {
    use idem_layer::fingerprint::is_json;
    let cases: [(&[u8], bool); 14] = [
        (b"application/json", true),
        (b"Application/JSON; charset=utf-8", true),
        (b" application/json ", true),
        (b"application/problem+json", true),
        (b"APPLICATION/VND.API+JSON;v=1", true),
        (b"application/+json", true),
        (b"text/json", false),
        (b"application/jsonx", false),
        (b"application/json+xml", false),
        (b"text/plain+json", false),
        (b"application/", false),
        (b"+json", false),
        (b"application/\xff+json", false),
        (b"", false),
    ];
    for (content_type, json) in cases {
        assert_eq!(
            is_json(content_type),
            json,
            "{}",
            String::from_utf8_lossy(content_type)
        );
    }
}
