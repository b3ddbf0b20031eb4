//! The operator's sessions: signing in with the admin token (throttled
//! per source), the session cookie, and the anti-forgery token every form
//! carries.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use axum::{
    http::{HeaderMap, HeaderValue, header},
    response::{IntoResponse, Redirect, Response},
};
use rand::Rng;
use sha2::Digest;

use super::{MAX_SESSIONS, Operator, SESSION_FOR};
use crate::owned::COOKIE;

/// A signed-in operator's session.
pub(super) struct Session {
    /// The anti-forgery token its forms carry.
    pub(super) csrf: String,
    pub(super) until: Instant,
}

/// How many wrong sign-ins one source may make at once.
pub(super) const SIGN_IN_BURST: f64 = 5.0;
/// How fast a source earns a sign-in back: one a second.
pub(super) const SIGN_IN_REFILL_PER_SECOND: f64 = 1.0;
/// The most sources remembered; the one whose budget is fullest (the
/// least suspect) goes first.
pub(super) const SIGN_IN_SOURCES: usize = 4096;

/// A source's sign-in budget: a token bucket that wrong tokens empty and
/// time refills. Per source, so a guesser elsewhere never locks the
/// operator out; a source whose budget is empty is answered `429` with
/// `Retry-After` before its token is even compared.
#[derive(Clone, Copy)]
pub(super) struct SignInBudget {
    left: f64,
    at: Instant,
}

impl SignInBudget {
    pub(super) fn full(now: Instant) -> Self {
        Self {
            left: SIGN_IN_BURST,
            at: now,
        }
    }

    /// The budget refilled up to `now`.
    pub(super) fn refilled(self, now: Instant) -> Self {
        let earned = now.duration_since(self.at).as_secs_f64() * SIGN_IN_REFILL_PER_SECOND;
        Self {
            left: (self.left + earned).min(SIGN_IN_BURST),
            at: now,
        }
    }
}

/// Equal digests, compared whole.
pub(super) fn same(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// 32 random bytes in hex.
pub(super) fn random_token() -> String {
    let bytes: [u8; 32] = rand::rng().random();
    hex::encode(bytes)
}

/// The fields of a form body.
pub(super) fn form(body: &[u8]) -> HashMap<String, String> {
    form_urlencoded::parse(body).into_owned().collect()
}

impl<S> Operator<S> {
    /// The session the request's cookie names, if it is live: its key and
    /// its anti-forgery token.
    pub(super) fn session(&self, headers: &HeaderMap) -> Option<([u8; 32], String)> {
        let id = headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(';'))
            .find_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))?;
        let key: [u8; 32] = sha2::Sha256::digest(id.as_bytes()).into();
        self.live_sessions()
            .get(&key)
            .map(|session| (key, session.csrf.clone()))
    }

    /// The sessions, those past their time removed.
    pub(super) fn live_sessions(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        let mut sessions = self
            .sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        sessions.retain(|_, session| session.until > now);
        sessions
    }

    /// Opens a session: the cookie that names it.
    pub(super) fn open(&self) -> String {
        let id = random_token();
        let key: [u8; 32] = sha2::Sha256::digest(id.as_bytes()).into();
        let mut sessions = self.live_sessions();
        let now = Instant::now();
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, session)| session.until)
                .map(|(key, _)| *key)
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            key,
            Session {
                csrf: random_token(),
                until: now + SESSION_FOR,
            },
        );
        self.cookie(&id, SESSION_FOR)
    }

    /// The session cookie naming `id`, for `lasting` (zero: removed).
    pub(super) fn cookie(&self, id: &str, lasting: Duration) -> String {
        format!(
            "{COOKIE}={id}; Path={}; HttpOnly; SameSite=Strict; Max-Age={}{}",
            self.path,
            lasting.as_secs(),
            if self.secure { "; Secure" } else { "" }
        )
    }

    /// Whether `source` may try a sign-in now; else how long until it may.
    pub(super) fn may_sign_in(&self, source: Option<std::net::IpAddr>) -> Result<(), Duration> {
        let Some(source) = source else { return Ok(()) };
        let attempts = self
            .attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(budget) = attempts.get(&source) else {
            return Ok(());
        };
        let budget = budget.refilled(Instant::now());
        if budget.left >= 1.0 {
            return Ok(());
        }
        let wait = (1.0 - budget.left) / SIGN_IN_REFILL_PER_SECOND;
        Err(Duration::from_secs_f64(wait.max(0.0)).max(Duration::from_secs(1)))
    }

    /// Takes one sign-in from `source`'s budget (a wrong token).
    pub(super) fn spend_sign_in(&self, source: Option<std::net::IpAddr>) {
        let Some(source) = source else { return };
        let mut attempts = self
            .attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if attempts.len() >= SIGN_IN_SOURCES && !attempts.contains_key(&source) {
            let fullest = attempts
                .iter()
                .max_by(|a, b| {
                    let (a, b) = (a.1.refilled(now).left, b.1.refilled(now).left);
                    a.total_cmp(&b)
                })
                .map(|(ip, _)| *ip);
            if let Some(fullest) = fullest {
                attempts.remove(&fullest);
            }
        }
        let budget = attempts
            .get(&source)
            .map_or_else(|| SignInBudget::full(now), |budget| budget.refilled(now));
        attempts.insert(
            source,
            SignInBudget {
                left: budget.left - 1.0,
                at: now,
            },
        );
    }

    /// A redirect to the page that sets `cookie`.
    pub(super) fn back_to_page(&self, cookie: &str) -> Response {
        let mut response = Redirect::to(&self.path).into_response();
        if let Ok(cookie) = HeaderValue::try_from(cookie) {
            response.headers_mut().insert(header::SET_COOKIE, cookie);
        }
        response
    }

    /// A form post that may act: a live session, and its anti-forgery
    /// token in the form.
    pub(super) fn authorized(
        &self,
        headers: &HeaderMap,
        fields: &HashMap<String, String>,
    ) -> Option<[u8; 32]> {
        let (key, csrf) = self.session(headers)?;
        let given = fields.get("csrf")?;
        let (given, expected): ([u8; 32], [u8; 32]) = (
            sha2::Sha256::digest(given.as_bytes()).into(),
            sha2::Sha256::digest(csrf.as_bytes()).into(),
        );
        same(&given, &expected).then_some(key)
    }
}
