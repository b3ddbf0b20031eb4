//! Tenants from a claim of a verified JWT (`--tenant-jwt-keys`).
//!
//! A caller keeps one tenant across refreshed tokens: the tenant is a
//! keyed hash of one claim (`sub` by default), read only after the token's
//! signature, algorithm and expiry (with a small leeway) check out. A
//! keyed request whose bearer token fails verification is refused with
//! `401 idempotency_tenant_invalid`: it never becomes a tenant of its own,
//! and an unverified claim is never used.
//!
//! The key file is one of:
//!
//! * a JWKS document (`{"keys": [...]}`): the token's `kid` picks the key,
//!   or the only key when the document holds one;
//! * a PEM public key: RSA (RS256/384/512, PS256/384/512), EC (ES256,
//!   ES384) or Ed25519 (EdDSA);
//! * anything else: an HMAC secret (HS256/384/512), the file's bytes
//!   without trailing whitespace, at least 32 bytes.

use std::{collections::HashMap, path::Path, sync::Arc, time::Duration};

use jsonwebtoken::{
    Algorithm, DecodingKey, Validation,
    jwk::{AlgorithmParameters, EllipticCurve, JwkSet},
};

/// Verification keys, with the algorithms each may sign with.
#[derive(Clone)]
enum Keys {
    /// One key for every token.
    Single(Arc<DecodingKey>, Vec<Algorithm>),
    /// Keys by `kid`; a document with one key uses it for tokens without a
    /// `kid` too.
    Set(
        Arc<HashMap<String, (DecodingKey, Vec<Algorithm>)>>,
        Option<String>,
    ),
}

/// Verifies bearer tokens and reads the tenant claim.
#[derive(Clone)]
pub(crate) struct JwtTenants {
    keys: Keys,
    claim: Arc<str>,
    leeway: Duration,
}

impl std::fmt::Debug for JwtTenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtTenants")
            .field("claim", &self.claim)
            .field("leeway", &self.leeway)
            .finish_non_exhaustive()
    }
}

const HMAC: [Algorithm; 3] = [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512];
const RSA: [Algorithm; 6] = [
    Algorithm::RS256,
    Algorithm::RS384,
    Algorithm::RS512,
    Algorithm::PS256,
    Algorithm::PS384,
    Algorithm::PS512,
];

/// The algorithms a JWK may verify: its `alg` if it names one, otherwise
/// those of its key type.
fn jwk_algorithms(jwk: &jsonwebtoken::jwk::Jwk) -> Result<Vec<Algorithm>, String> {
    if let Some(alg) = &jwk.common.key_algorithm {
        let alg: Algorithm = alg
            .to_string()
            .parse()
            .map_err(|_| format!("JWK algorithm {alg} cannot sign a JWT"))?;
        return Ok(vec![alg]);
    }
    Ok(match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => RSA.to_vec(),
        AlgorithmParameters::OctetKey(_) => HMAC.to_vec(),
        AlgorithmParameters::OctetKeyPair(_) => vec![Algorithm::EdDSA],
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => vec![Algorithm::ES256],
            EllipticCurve::P384 => vec![Algorithm::ES384],
            _ => return Err("unsupported elliptic curve in the JWKS".to_owned()),
        },
    })
}

fn load(bytes: &[u8]) -> Result<Keys, String> {
    let text = String::from_utf8_lossy(bytes);
    let trimmed = text.trim();
    if trimmed.starts_with('{') {
        let set: JwkSet =
            serde_json::from_str(trimmed).map_err(|e| format!("not a JWKS document: {e}"))?;
        let only =
            (set.keys.len() == 1).then(|| set.keys[0].common.key_id.clone().unwrap_or_default());
        let mut keys = HashMap::new();
        for jwk in &set.keys {
            let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("unusable JWK: {e}"))?;
            let kid = jwk.common.key_id.clone().unwrap_or_default();
            keys.insert(kid, (key, jwk_algorithms(jwk)?));
        }
        if keys.is_empty() {
            return Err("the JWKS document holds no key".to_owned());
        }
        return Ok(Keys::Set(Arc::new(keys), only));
    }
    if trimmed.starts_with("-----BEGIN") {
        let pem = trimmed.as_bytes();
        if let Ok(key) = DecodingKey::from_rsa_pem(pem) {
            return Ok(Keys::Single(Arc::new(key), RSA.to_vec()));
        }
        if let Ok(key) = DecodingKey::from_ec_pem(pem) {
            return Ok(Keys::Single(
                Arc::new(key),
                vec![Algorithm::ES256, Algorithm::ES384],
            ));
        }
        if let Ok(key) = DecodingKey::from_ed_pem(pem) {
            return Ok(Keys::Single(Arc::new(key), vec![Algorithm::EdDSA]));
        }
        return Err("the PEM file holds no RSA, EC or Ed25519 public key".to_owned());
    }
    let secret = bytes.trim_ascii_end();
    if secret.len() < 32 {
        return Err("an HMAC secret must be at least 32 bytes".to_owned());
    }
    Ok(Keys::Single(
        Arc::new(DecodingKey::from_secret(secret)),
        HMAC.to_vec(),
    ))
}

impl JwtTenants {
    /// Reads the key file.
    pub(crate) fn from_file(path: &Path, claim: &str, leeway: Duration) -> Result<Self, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cannot read the JWT key file {}: {e}", path.display()))?;
        let keys = load(&bytes).map_err(|e| format!("JWT key file {}: {e}", path.display()))?;
        Ok(Self {
            keys,
            claim: claim.into(),
            leeway,
        })
    }

    /// The verified claim of a bearer `Authorization` value, or why not.
    pub(crate) fn claim(&self, authorization: &[u8]) -> Result<String, String> {
        let value = std::str::from_utf8(authorization)
            .map_err(|_| "the Authorization value is not text".to_owned())?
            .trim();
        let (scheme, token) = value
            .split_once(|c: char| c.is_ascii_whitespace())
            .ok_or_else(|| "expected Authorization: Bearer <token>".to_owned())?;
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err("expected Authorization: Bearer <token>".to_owned());
        }
        let token = token.trim();
        let header =
            jsonwebtoken::decode_header(token).map_err(|e| format!("malformed token: {e}"))?;
        let (key, algorithms) = match &self.keys {
            Keys::Single(key, algorithms) => (&**key, algorithms),
            Keys::Set(keys, only) => {
                let kid = header
                    .kid
                    .clone()
                    .or_else(|| only.clone())
                    .unwrap_or_default();
                let (key, algorithms) = keys
                    .get(&kid)
                    .ok_or_else(|| "the token's key id is not in the key set".to_owned())?;
                (key, algorithms)
            }
        };
        if !algorithms.contains(&header.alg) {
            return Err(format!(
                "algorithm {:?} is not accepted for this key",
                header.alg
            ));
        }
        let mut validation = Validation::new(header.alg);
        validation.algorithms = algorithms.clone();
        validation.leeway = self.leeway.as_secs();
        validation.validate_exp = true;
        validation.validate_nbf = true;
        validation.validate_aud = false;
        let data = jsonwebtoken::decode::<serde_json::Map<String, serde_json::Value>>(
            token,
            key,
            &validation,
        )
        .map_err(|e| format!("token rejected: {e}"))?;
        match data.claims.get(&*self.claim) {
            Some(serde_json::Value::String(text)) if !text.is_empty() => Ok(text.clone()),
            Some(serde_json::Value::Number(number)) => Ok(number.to_string()),
            _ => Err(format!("the token has no {} claim", self.claim)),
        }
    }
}
