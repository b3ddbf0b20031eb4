//! Stored responses sealed at rest.
//!
//! With a [`Keyring`] on the layer ([`IdempotencyLayer::sealing`](crate::IdempotencyLayer::sealing)),
//! the headers and body of every response the layer stores are encrypted
//! with XChaCha20-Poly1305 before they reach the store, and opened when a
//! retry replays them. Whoever reads the store (its memory, an AOF, a
//! backup, a replica, the PostgreSQL table) reads the status and
//! ciphertext, never the response.
//!
//! * **What is sealed.** A stored response keeps its status in clear (the
//!   records API and the store's own logic read it); its headers and body
//!   become one ciphertext. The stored headers are then one field,
//!   `idem-sealed`, whose value names the key (a name idem reserves).
//! * **Bound to its record.** The associated data is the scope hash, the
//!   attempt that stored it (its id, unique to that attempt of that
//!   record: a record erased and made again has new attempts), the status
//!   and the key id. The attempt is the one the store says the record's
//!   outcome is of ([`Replay::attempt`]), never a claim the envelope makes:
//!   a sealed response copied into another record, or into the same
//!   scope's record after an erase, or given another status, does not
//!   open. (Envelopes of the first version, bound to the lease generation
//!   they carried, still open as they did.)
//! * **Nonces.** Each seal draws a fresh 192-bit nonce: random nonces of
//!   that size stay safe however many records are sealed under one key.
//! * **Keys.** A keyring holds the key new records are sealed with (the
//!   current one) and older keys that still open records sealed before a
//!   rotation, until those expire. Rotating never changes tenant or scope
//!   hashes (they have their own secret). [`Keyring::derived`] derives a
//!   key from a deployment secret under a label of its own, so one secret
//!   can serve both without one revealing the other.
//! * **A record that does not open is never replayed**: its key is not in
//!   the keyring, or the ciphertext or its binding was changed. The retry
//!   gets `503 idempotency_store_unavailable` (the store answered, so a
//!   layer that fails open does not run it either), and
//!   `idem_records_unopened_total` counts it.
//! * **Records stored without sealing** (before it was turned on, or by a
//!   process without it) replay as they are, so sealing can be turned on
//!   in a running fleet.
//!
//! XChaCha20-Poly1305 is ring's ChaCha20-Poly1305 under the subkey
//! HChaCha20 derives from the key and the nonce's first 16 bytes (the
//! standard construction). Sealing a 1 KB response costs about 0.7 µs of
//! CPU here, opening it about 1 µs, and no store round trip
//! (`cargo bench -p idem-layer --bench sealing`).

use std::{collections::BTreeMap, fmt, sync::Arc};

use bytes::{BufMut, Bytes};
use http::HeaderName;
use idem_core::{
    AttemptId, Completion, Current, Outcome, Release, Replay, Reservation, ScopeHash, StoreError,
    StoredResponse,
};
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};

/// The header a sealed response is stored under; its value is the key id.
pub const SEALED: HeaderName = HeaderName::from_static("idem-sealed");

/// The HKDF label of a key derived from a deployment secret.
const DERIVED_LABEL: &[u8] = b"idem sealing key v1";
/// The version byte of a sealed body: 2, bound to the attempt the record
/// names; 1 (read only), bound to the generation the envelope carries.
const ENVELOPE: u8 = 2;
const ENVELOPE_V1: u8 = 1;
/// The bytes before the ciphertext: version, nonce.
const HEAD: usize = 1 + 24;
/// The bytes before a version 1 ciphertext: version, generation, nonce.
const HEAD_V1: usize = 1 + 8 + 24;
/// The Poly1305 tag after it.
const TAG: usize = 16;

/// The keys that seal and open stored responses: the current one seals,
/// every one opens. Cloning shares the keys.
#[derive(Clone)]
pub struct Keyring {
    current: u32,
    keys: Arc<BTreeMap<u32, [u8; 32]>>,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current)
            .field("ids", &self.keys.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Keyring {
    /// A keyring whose key `id` seals new records.
    pub fn new(id: u32, key: [u8; 32]) -> Self {
        let mut keys = BTreeMap::new();
        keys.insert(id, key);
        Self {
            current: id,
            keys: Arc::new(keys),
        }
    }

    /// The key a deployment secret gives (HKDF-SHA256 under a label of its
    /// own), as key `0`: the same secret gives the same key in every
    /// process, and nothing about the secret or its other uses (tenant and
    /// scope hashes) can be learnt from it.
    pub fn derived(secret: &[u8]) -> Self {
        Self::new(0, derive(secret))
    }

    /// Adds key `id` to open records with, without sealing with it: the
    /// first step of a rolling rotation. Add the new key this way on every
    /// process first, then make it the sealing key
    /// ([`rotated_to`](Self::rotated_to)) one process at a time: every
    /// process opens what any of them seals at every step, and no retry
    /// meets a record it cannot open. (A key already here is replaced.)
    #[must_use]
    pub fn opening(mut self, id: u32, key: [u8; 32]) -> Self {
        Arc::make_mut(&mut self.keys).insert(id, key);
        self
    }

    /// Adds key `id` and makes it the one new records are sealed with; the
    /// keys already here still open the records they sealed (a rotation).
    #[must_use]
    pub fn rotated_to(mut self, id: u32, key: [u8; 32]) -> Self {
        Arc::make_mut(&mut self.keys).insert(id, key);
        self.current = id;
        self
    }

    /// The id of the key new records are sealed with.
    pub fn current(&self) -> u32 {
        self.current
    }

    /// `response`, sealed for the record `scope` as the outcome of its
    /// attempt `attempt`.
    pub(crate) fn seal(
        &self,
        scope: &ScopeHash,
        attempt: AttemptId,
        response: &StoredResponse,
    ) -> StoredResponse {
        let plain_len = 4
            + response
                .headers
                .iter()
                .map(|(n, v)| 6 + n.as_str().len() + v.len())
                .sum::<usize>()
            + response.body.len();
        // One buffer: the envelope's head, then the plaintext sealed in
        // place, then the tag.
        let mut body = Vec::with_capacity(HEAD + plain_len + TAG);
        let nonce: [u8; 24] = rand::random();
        body.put_u8(ENVELOPE);
        body.put_slice(&nonce);
        body.put_u32(u32::try_from(response.headers.len()).unwrap_or(u32::MAX));
        for (name, value) in &response.headers {
            let name = name.as_str().as_bytes();
            // Header names are short and values bounded by the server's
            // head limit: the lengths fit.
            body.put_u16(u16::try_from(name.len()).unwrap_or(u16::MAX));
            body.put_slice(name);
            body.put_u32(u32::try_from(value.len()).unwrap_or(u32::MAX));
            body.put_slice(value);
        }
        body.put_slice(&response.body);
        let aad = associated(
            scope,
            Bound::Attempt(attempt),
            response.status,
            self.current,
        );
        let key = cipher(&self.keys[&self.current], &nonce);
        // Sealing fails only for a message beyond the cipher's limit
        // (256 GiB), far past any storable response.
        if let Ok(tag) = key
            .0
            .seal_in_place_separate_tag(key.1, Aad::from(&aad), &mut body[HEAD..])
        {
            body.extend_from_slice(tag.as_ref());
        }
        let body = Bytes::from(body);
        StoredResponse {
            status: response.status,
            headers: vec![(SEALED, Bytes::from(self.current.to_string()))],
            body,
        }
    }

    /// `response` opened, if it was sealed; as it is, if it was not.
    /// `attempt` is the attempt the store says the record's outcome is of:
    /// a sealed response opens only for it (`None`: a store that does not
    /// say, and no sealed response of this version opens).
    pub(crate) fn open(
        &self,
        scope: &ScopeHash,
        attempt: Option<AttemptId>,
        response: StoredResponse,
    ) -> Result<StoredResponse, Unopened> {
        let [(name, id)] = &response.headers[..] else {
            return Ok(response);
        };
        if *name != SEALED {
            return Ok(response);
        }
        let id: u32 = std::str::from_utf8(id)
            .ok()
            .and_then(|id| id.parse().ok())
            .ok_or(Unopened::Damaged)?;
        let key = self.keys.get(&id).ok_or(Unopened::UnknownKey(id))?;
        let body = &response.body;
        let (bound, head) = match body.first() {
            Some(&ENVELOPE) => (Bound::Attempt(attempt.ok_or(Unopened::Damaged)?), HEAD),
            Some(&ENVELOPE_V1) if body.len() >= HEAD_V1 => {
                let generation =
                    u64::from_be_bytes(body[1..9].try_into().map_err(|_| Unopened::Damaged)?);
                (Bound::Generation(generation), HEAD_V1)
            }
            _ => return Err(Unopened::Damaged),
        };
        if body.len() < head + TAG {
            return Err(Unopened::Damaged);
        }
        let nonce: [u8; 24] = body[head - 24..head]
            .try_into()
            .map_err(|_| Unopened::Damaged)?;
        let aad = associated(scope, bound, response.status, id);
        let mut sealed = body[head..].to_vec();
        let key = cipher(key, &nonce);
        let opened = key
            .0
            .open_in_place(key.1, Aad::from(&aad), &mut sealed)
            .map_err(|_| Unopened::Damaged)?
            .len();
        sealed.truncate(opened);
        let plain = Bytes::from(sealed);
        let mut at = 0;
        let mut take = |n: usize| -> Result<Bytes, Unopened> {
            let end = at + n;
            let part = plain.get(at..end).ok_or(Unopened::Damaged)?;
            at = end;
            Ok(plain.slice_ref(part))
        };
        let count = u32::from_be_bytes(take(4)?[..].try_into().map_err(|_| Unopened::Damaged)?);
        let mut headers = Vec::with_capacity(count.min(256) as usize);
        for _ in 0..count {
            let len = u16::from_be_bytes(take(2)?[..].try_into().map_err(|_| Unopened::Damaged)?);
            let name =
                HeaderName::from_bytes(&take(usize::from(len))?).map_err(|_| Unopened::Damaged)?;
            let len = u32::from_be_bytes(take(4)?[..].try_into().map_err(|_| Unopened::Damaged)?);
            headers.push((name, take(len as usize)?));
        }
        let body = plain.slice(at..);
        Ok(StoredResponse {
            status: response.status,
            headers,
            body,
        })
    }
}

/// A stored response read without a keyring: as it is, unless it is
/// sealed (it does not open without its key, and its ciphertext is no
/// response to replay).
fn unsealed(response: StoredResponse) -> Result<StoredResponse, Unopened> {
    match &response.headers[..] {
        [(name, id)] if *name == SEALED => Err(Unopened::UnknownKey(
            std::str::from_utf8(id)
                .ok()
                .and_then(|id| id.parse().ok())
                .unwrap_or(u32::MAX),
        )),
        _ => Ok(response),
    }
}

/// XChaCha20-Poly1305 for `key` and a 192-bit `nonce`: ChaCha20-Poly1305
/// under the subkey HChaCha20 derives from the key and the nonce's first
/// 16 bytes, with the nonce's last 8 as its own (after four zero bytes).
fn cipher(key: &[u8; 32], nonce: &[u8; 24]) -> (LessSafeKey, Nonce) {
    use chacha20::cipher::{consts::U10, generic_array::GenericArray};
    let subkey = chacha20::hchacha::<U10>(
        GenericArray::from_slice(key),
        GenericArray::from_slice(&nonce[..16]),
    );
    let mut inner = [0; 12];
    inner[4..].copy_from_slice(&nonce[16..]);
    // A 32-byte key is what ChaCha20-Poly1305 takes: never refused.
    let unbound = UnboundKey::new(&CHACHA20_POLY1305, &subkey)
        .unwrap_or_else(|_| unreachable!("a 32-byte key"));
    (
        LessSafeKey::new(unbound),
        Nonce::assume_unique_for_key(inner),
    )
}

/// The 32-byte key HKDF-SHA256 gives `secret` under idem's sealing label.
fn derive(secret: &[u8]) -> [u8; 32] {
    let mut key = [0; 32];
    // 32 bytes is far below HKDF-SHA256's limit of 8,160.
    let _ = hkdf::Hkdf::<sha2::Sha256>::new(None, secret).expand(DERIVED_LABEL, &mut key);
    key
}

/// What a sealed response is bound to besides its record's scope.
#[derive(Clone, Copy)]
enum Bound {
    /// The attempt whose outcome it is (envelope version 2).
    Attempt(AttemptId),
    /// The lease generation the envelope carries (version 1, read only).
    Generation(u64),
}

/// The associated data a sealed response is bound by (on the stack: no
/// allocation per seal).
struct Associated {
    bytes: [u8; 70],
    len: usize,
}

impl AsRef<[u8]> for Associated {
    fn as_ref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// The associated data a sealed response is bound by.
fn associated(scope: &ScopeHash, bound: Bound, status: u16, key: u32) -> Associated {
    let mut aad = Associated {
        bytes: [0; 70],
        len: 0,
    };
    let mut put = |part: &[u8]| {
        aad.bytes[aad.len..aad.len + part.len()].copy_from_slice(part);
        aad.len += part.len();
    };
    match bound {
        Bound::Attempt(attempt) => {
            put(b"idem-sealed-v2\0\0");
            put(scope.as_bytes());
            put(attempt.0.as_bytes());
        }
        Bound::Generation(generation) => {
            put(b"idem-sealed-v1\0\0");
            put(scope.as_bytes());
            put(&generation.to_be_bytes());
        }
    }
    put(&status.to_be_bytes());
    put(&key.to_be_bytes());
    aad
}

/// Why a sealed response did not open.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unopened {
    /// Sealed under a key this keyring does not hold.
    #[error(
        "a stored response is sealed under key {0}, which this process's keyring does not hold"
    )]
    UnknownKey(u32),
    /// Changed, moved to another record, or not sealed by idem.
    #[error("a stored response did not open: it was changed, or belongs to another record")]
    Damaged,
}

impl From<Unopened> for StoreError {
    fn from(unopened: Unopened) -> Self {
        metrics::counter!(UNOPENED).increment(1);
        tracing::error!(%unopened, "a stored response did not open; it is not replayed");
        StoreError::refused(unopened)
    }
}

/// The counter of stored responses that did not open.
pub const UNOPENED: &str = "idem_records_unopened_total";

/// Store answers that may carry a stored response: opened in place.
pub(crate) trait Opens: Sized {
    /// `self` with every sealed response in it opened (without a keyring,
    /// a sealed response is an error).
    fn opened(self, keyring: Option<&Keyring>, scope: &ScopeHash) -> Result<Self, StoreError>;
}

impl Opens for Replay {
    fn opened(mut self, keyring: Option<&Keyring>, scope: &ScopeHash) -> Result<Self, StoreError> {
        if let Outcome::Stored(stored) = self.outcome {
            self.outcome = Outcome::Stored(match keyring {
                Some(keyring) => keyring.open(scope, self.attempt, stored)?,
                None => unsealed(stored)?,
            });
        }
        Ok(self)
    }
}

impl Opens for Current {
    fn opened(self, keyring: Option<&Keyring>, scope: &ScopeHash) -> Result<Self, StoreError> {
        match self {
            Current::Completed(replay) => Ok(Current::Completed(replay.opened(keyring, scope)?)),
            other => Ok(other),
        }
    }
}

impl Opens for Reservation {
    fn opened(self, keyring: Option<&Keyring>, scope: &ScopeHash) -> Result<Self, StoreError> {
        match self {
            Reservation::Completed(replay) => {
                Ok(Reservation::Completed(replay.opened(keyring, scope)?))
            }
            other => Ok(other),
        }
    }
}

impl Opens for Completion {
    fn opened(self, keyring: Option<&Keyring>, scope: &ScopeHash) -> Result<Self, StoreError> {
        match self {
            Completion::Fenced(current) => Ok(Completion::Fenced(current.opened(keyring, scope)?)),
            Completion::Recorded => Ok(Completion::Recorded),
        }
    }
}

impl Opens for Release {
    fn opened(self, keyring: Option<&Keyring>, scope: &ScopeHash) -> Result<Self, StoreError> {
        match self {
            Release::Fenced(current) => Ok(Release::Fenced(current.opened(keyring, scope)?)),
            Release::Released => Ok(Release::Released),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// XChaCha20-Poly1305 as published: the AEAD test vector of
    /// draft-irtf-cfrg-xchacha-03, appendix A.3.1 (key, nonce, associated
    /// data and plaintext in, ciphertext and tag out), through the same
    /// construction the keyring seals with (HChaCha20 subkey, then ring's
    /// ChaCha20-Poly1305), both ways.
    #[test]
    fn xchacha20_poly1305_matches_the_published_vector() {
        let hex =
            |text: &str| hex::decode(text.split_whitespace().collect::<String>()).expect("hex");
        let key: [u8; 32] = hex("808182838485868788898a8b8c8d8e8f909192939495969798999a9b9c9d9e9f")
            .try_into()
            .expect("key");
        let nonce: [u8; 24] = hex("404142434445464748494a4b4c4d4e4f5051525354555657")
            .try_into()
            .expect("nonce");
        let aad = hex("50515253c0c1c2c3c4c5c6c7");
        let plaintext = b"Ladies and Gentlemen of the class of '99: If I could offer you only one \
                          tip for the future, sunscreen would be it.";
        let ciphertext = hex(
            "bd6d179d3e83d43b9576579493c0e939572a1700252bfaccbed2902c21396cbb
             731c7f1b0b4aa6440bf3a82f4eda7e39ae64c6708c54c216cb96b72e1213b452
             2f8c9ba40db5d945b11b69b982c1bb9e3f3fac2bc369488f76b2383565d3fff9
             21f9664c97637da9768812f615c68b13b52e",
        );
        let tag = hex("c0875924c1c7987947deafd8780acf49");
        let mut sealed = plaintext.to_vec();
        let key_in = cipher(&key, &nonce);
        let got_tag = key_in
            .0
            .seal_in_place_separate_tag(key_in.1, Aad::from(&aad), &mut sealed)
            .expect("seal");
        assert_eq!(sealed, ciphertext);
        assert_eq!(got_tag.as_ref(), &tag[..]);
        let mut opened = [ciphertext, tag].concat();
        let key_out = cipher(&key, &nonce);
        let plain = key_out
            .0
            .open_in_place(key_out.1, Aad::from(&aad), &mut opened)
            .expect("open");
        assert_eq!(plain, &plaintext[..]);
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![
                (http::header::LOCATION, Bytes::from_static(b"/orders/7")),
                (
                    HeaderName::from_static("x-card"),
                    Bytes::from_static(b"4242"),
                ),
            ],
            body: Bytes::from_static(b"{\"sku\":\"MARKER\"}"),
        }
    }

    proptest::proptest! {
        /// Any stored bytes under the sealed header open or are refused,
        /// never a panic, whatever the version byte, the length or the key.
        #[test]
        fn any_envelope_opens_or_is_refused(
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..120),
            id in "[0-9]{0,3}",
            attempt_given in proptest::prelude::any::<bool>(),
        ) {
            let keyring = Keyring::derived(b"a deployment secret of some length");
            let sealed = StoredResponse {
                status: 201,
                headers: vec![(SEALED, Bytes::from(id))],
                body: body.into(),
            };
            let _ = keyring.open(&scope(1), attempt_given.then(|| attempt(1)), sealed);
        }

        /// Every response sealed opens to itself, byte for byte.
        #[test]
        fn every_sealed_response_round_trips(
            status in 200u16..600,
            body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            value in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
        ) {
            let keyring = Keyring::derived(b"a deployment secret of some length");
            let response = StoredResponse {
                status,
                headers: vec![(http::header::LOCATION, Bytes::from(value))],
                body: body.into(),
            };
            let sealed = keyring.seal(&scope(3), attempt(3), &response);
            proptest::prop_assert_eq!(keyring.open(&scope(3), Some(attempt(3)), sealed).expect("opens"), response);
        }
    }

    fn attempt(n: u8) -> AttemptId {
        AttemptId(uuid::Uuid::from_bytes([n; 16]))
    }

    /// A version 1 envelope (bound to the generation it carries), as
    /// earlier versions sealed: it still opens, whatever the attempt.
    #[test]
    fn a_first_version_envelope_still_opens() {
        let keyring = Keyring::derived(b"a deployment secret of some length");
        let plain = response();
        let nonce = [9u8; 24];
        let mut body = vec![ENVELOPE_V1];
        body.extend_from_slice(&5u64.to_be_bytes());
        body.extend_from_slice(&nonce);
        body.extend_from_slice(
            &u32::try_from(plain.headers.len())
                .expect("few")
                .to_be_bytes(),
        );
        for (name, value) in &plain.headers {
            let name = name.as_str().as_bytes();
            body.extend_from_slice(&u16::try_from(name.len()).expect("short").to_be_bytes());
            body.extend_from_slice(name);
            body.extend_from_slice(&u32::try_from(value.len()).expect("short").to_be_bytes());
            body.extend_from_slice(value);
        }
        body.extend_from_slice(&plain.body);
        let aad = associated(&scope(1), Bound::Generation(5), 201, 0);
        let key = cipher(&keyring.keys[&0], &nonce);
        let tag = key
            .0
            .seal_in_place_separate_tag(key.1, Aad::from(&aad), &mut body[HEAD_V1..])
            .expect("seal");
        body.extend_from_slice(tag.as_ref());
        let sealed = StoredResponse {
            status: 201,
            headers: vec![(SEALED, Bytes::from_static(b"0"))],
            body: body.into(),
        };
        assert_eq!(
            keyring.open(&scope(1), None, sealed.clone()).expect("v1"),
            plain
        );
        assert_eq!(
            keyring
                .open(&scope(1), Some(attempt(4)), sealed)
                .expect("v1"),
            plain
        );
    }

    fn scope(n: u8) -> ScopeHash {
        ScopeHash::from_bytes([n; 32])
    }

    #[test]
    fn a_sealed_response_opens_byte_for_byte_and_shows_nothing() {
        let keyring = Keyring::derived(b"a deployment secret of some length");
        let sealed = keyring.seal(&scope(1), attempt(3), &response());
        assert_eq!(sealed.status, 201);
        assert_eq!(sealed.headers, vec![(SEALED, Bytes::from_static(b"0"))]);
        let raw = format!("{:?}", sealed.body);
        for clear in ["MARKER", "orders", "4242", "x-card"] {
            assert!(!raw.contains(clear), "{clear} in {raw}");
        }
        assert_eq!(
            keyring
                .open(&scope(1), Some(attempt(3)), sealed)
                .expect("opens"),
            response()
        );
        // Two seals of one response differ (fresh nonces).
        assert_ne!(
            keyring.seal(&scope(1), attempt(3), &response()).body,
            keyring.seal(&scope(1), attempt(3), &response()).body
        );
    }

    #[test]
    fn a_sealed_response_opens_only_in_its_own_record_with_its_key() {
        let keyring = Keyring::derived(b"a deployment secret of some length");
        let sealed = keyring.seal(&scope(1), attempt(1), &response());
        let own = Some(attempt(1));
        // Another record.
        assert_eq!(
            keyring.open(&scope(2), own, sealed.clone()),
            Err(Unopened::Damaged)
        );
        // Another status.
        let mut restatused = sealed.clone();
        restatused.status = 200;
        assert_eq!(
            keyring.open(&scope(1), own, restatused),
            Err(Unopened::Damaged)
        );
        // Another attempt of the same record (made again after an erase,
        // say): the record's attempt binds it, whatever the envelope says.
        assert_eq!(
            keyring.open(&scope(1), Some(attempt(2)), sealed.clone()),
            Err(Unopened::Damaged)
        );
        // A store that names no attempt opens nothing sealed.
        assert_eq!(
            keyring.open(&scope(1), None, sealed.clone()),
            Err(Unopened::Damaged)
        );
        // A flipped ciphertext bit.
        let mut flipped = sealed.clone();
        let mut body = flipped.body.to_vec();
        let last = body.len() - 1;
        body[last] ^= 1;
        flipped.body = body.into();
        assert_eq!(
            keyring.open(&scope(1), own, flipped),
            Err(Unopened::Damaged)
        );
        // Another secret: its key 0 is another key.
        let other = Keyring::derived(b"another deployment secret entirely");
        assert_eq!(
            other.open(&scope(1), own, sealed.clone()),
            Err(Unopened::Damaged)
        );
        // A key the ring does not hold.
        let mut renamed = sealed;
        renamed.headers = vec![(SEALED, Bytes::from_static(b"9"))];
        assert_eq!(
            keyring.open(&scope(1), own, renamed),
            Err(Unopened::UnknownKey(9))
        );
    }

    #[test]
    fn after_a_rotation_both_keys_open_and_the_new_one_seals() {
        let before = Keyring::derived(b"a deployment secret of some length");
        let old = before.seal(&scope(1), attempt(1), &response());
        let after = before.clone().rotated_to(7, [7; 32]);
        assert_eq!(after.current(), 7);
        let new = after.seal(&scope(1), attempt(2), &response());
        assert_eq!(new.headers[0].1, Bytes::from_static(b"7"));
        assert_eq!(
            after
                .open(&scope(1), Some(attempt(1)), old)
                .expect("old key"),
            response()
        );
        assert_eq!(
            after
                .open(&scope(1), Some(attempt(2)), new.clone())
                .expect("new key"),
            response()
        );
        // The ring before the rotation does not know key 7.
        assert_eq!(
            before.open(&scope(1), Some(attempt(2)), new),
            Err(Unopened::UnknownKey(7))
        );
    }

    #[test]
    fn an_unsealed_response_is_left_as_it_is() {
        let keyring = Keyring::new(1, [1; 32]);
        assert_eq!(
            keyring.open(&scope(1), None, response()).expect("as is"),
            response()
        );
        let empty = StoredResponse {
            status: 204,
            headers: Vec::new(),
            body: Bytes::new(),
        };
        let sealed = keyring.seal(&scope(1), attempt(1), &empty);
        assert_eq!(
            keyring
                .open(&scope(1), Some(attempt(1)), sealed)
                .expect("opens"),
            empty
        );
    }

    #[test]
    fn a_derived_key_depends_on_the_secret_only() {
        assert_eq!(derive(b"one secret"), derive(b"one secret"));
        assert_ne!(derive(b"one secret"), derive(b"two secret"));
        assert_ne!(derive(b"one secret"), [0; 32]);
    }
}
