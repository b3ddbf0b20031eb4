//! The `Idempotency-Key` vectors of the contract.

use idem_core::IdempotencyKey;

#[test]
fn key_vectors() {
    let vectors = include_str!("fixtures/idempotency-key.jsonl");
    let mut checked = 0;
    for line in vectors.lines().filter(|l| !l.trim().is_empty()) {
        let case: serde_json::Value = serde_json::from_str(line).expect("fixture line is JSON");
        let header = case["header"].as_str().expect("header");
        let note = case["note"].as_str().unwrap_or_default();
        let parsed = IdempotencyKey::parse(header.as_bytes());
        match (case.get("key").and_then(|k| k.as_str()), parsed) {
            (Some(expected), Ok(key)) => assert_eq!(key.as_str(), expected, "{note}"),
            (Some(expected), Err(e)) => panic!("{note}: expected key {expected:?}, got {e}"),
            (None, Ok(key)) => panic!("{note}: expected an error, got key {:?}", key.as_str()),
            (None, Err(_)) => {
                assert_eq!(case["error"], "idempotency_key_invalid", "{note}");
            }
        }
        checked += 1;
    }
    assert!(checked >= 20, "only {checked} vectors read");
}
