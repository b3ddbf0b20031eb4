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

mod hostile {
    use idem_core::IdempotencyKey;
    use proptest::prelude::*;

    /// Writes a key as an RFC 8941 sf-string.
    fn quoted(key: &str) -> String {
        let mut out = String::from("\"");
        for c in key.chars() {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        }
        out.push('"');
        out
    }

    proptest! {
        /// Arbitrary bytes never panic, and whatever parses is 1..=255
        /// printable ASCII characters.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            if let Ok(key) = IdempotencyKey::parse(&bytes) {
                prop_assert!((1..=255).contains(&key.as_str().len()));
                prop_assert!(key.as_str().bytes().all(|b| (0x20..=0x7E).contains(&b)));
            }
        }

        /// Any printable key survives quoting as an sf-string; a key without
        /// spaces, quotes or backslashes also parses bare, to the same key.
        #[test]
        fn format_and_parse_round_trip(key in "[ -~]{1,255}") {
            let parsed = IdempotencyKey::parse(quoted(&key).as_bytes()).expect("a quoted key parses");
            prop_assert_eq!(parsed.as_str(), key.as_str());
            let bare_friendly = !key.starts_with('"') && key.bytes().all(|b| (0x21..=0x7E).contains(&b));
            if bare_friendly {
                let bare = IdempotencyKey::parse(key.as_bytes()).expect("a visible-ASCII key parses bare");
                prop_assert_eq!(bare, parsed);
            }
        }

        /// Longer than 255 characters is always refused, in both forms.
        #[test]
        fn too_long_is_refused(key in "[a-z]{256,400}") {
            prop_assert!(IdempotencyKey::parse(key.as_bytes()).is_err());
            prop_assert!(IdempotencyKey::parse(quoted(&key).as_bytes()).is_err());
        }
    }
}

/// The sf-string form parses back to the same key, and `Display` shows the
/// key while `Debug` keeps it out of logs.
#[test]
fn sf_string_form_round_trips() {
    for header in [
        r#"abc"#,
        r#""a b""#,
        r#""quote\"d""#,
        r#""back\\slash""#,
        r#"~!#$%&'()*+,-./:;<=>?@[]^_`{|}"#,
    ] {
        let key = IdempotencyKey::parse(header.as_bytes()).expect("key");
        let again = IdempotencyKey::parse(key.to_sf_string().as_bytes()).expect("sf-string");
        assert_eq!(again, key, "{header}");
        assert_eq!(key.to_string(), key.as_str());
        assert_eq!(format!("{key:?}"), r#"IdempotencyKey("<redacted>")"#);
    }
    // The exact spelling: quoted, with `"` and `\` escaped and nothing else.
    for (header, sf) in [
        (r#"abc"#, r#""abc""#),
        (r#""q\"d\\e\"""#, r#""q\"d\\e\"""#),
        (r#"a"b\c"#, r#""a\"b\\c""#),
    ] {
        let key = IdempotencyKey::parse(header.as_bytes()).expect("key");
        assert_eq!(key.to_sf_string(), sf, "{header}");
    }
}
