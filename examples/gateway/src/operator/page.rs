//! The operator page's HTML: the document, the sign-in form, and the
//! page's tables (records by state, lapsed and processing records, records
//! per tenant, recent unknown outcomes).

use std::{
    fmt::Write as _,
    time::{Duration, UNIX_EPOCH},
};

use axum::{
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use idem_core::{Record, RecordState};

use super::{LISTED, Operator};

/// A page's response: HTML, never cached, never framed.
pub(super) fn html(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'",
        ),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

/// Text made safe inside HTML (element content and quoted attributes).
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

pub(super) const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}\
table{border-collapse:collapse;margin:.5em 0 1.5em}\
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}\
th{background:#f3f3f3}code{font-size:12px}.note{color:#555}\
.flash{background:#e8f5e9;border:1px solid #a5d6a7;padding:.5em 1em}\
.error{background:#ffebee;border:1px solid #ef9a9a;padding:.5em 1em}\
button{cursor:pointer}";

pub(super) fn document(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{}</title><style>{STYLE}</style></head><body>{body}</body></html>",
        escape(title)
    )
}

pub(super) fn sign_in_page(path: &str, error: Option<&str>) -> String {
    let error = error
        .map(|e| format!("<p class=\"error\">{}</p>", escape(e)))
        .unwrap_or_default();
    document(
        "idem operator: sign in",
        &format!(
            "<h1>idem operator</h1>{error}\
             <form method=\"post\" action=\"{path}/sign-in\">\
             <label>Records admin token <input type=\"password\" name=\"token\" \
             autocomplete=\"current-password\" required></label> \
             <button type=\"submit\">Sign in</button></form>\
             <p class=\"note\">The token is the gateway's --records-admin-token.</p>",
            path = escape(path)
        ),
    )
}

/// How long ago `then_ms` was, at `now_ms`, to the second.
pub(super) fn ago(now_ms: u64, then_ms: u64) -> String {
    let seconds = now_ms.saturating_sub(then_ms) / 1000;
    humantime::format_duration(Duration::from_secs(seconds)).to_string()
}

/// A shortened tenant hash or scope, for reading.
pub(super) fn short(text: &str) -> &str {
    text.get(..16).unwrap_or(text)
}

/// A table of records, each with a release button.
pub(super) fn record_table(
    out: &mut String,
    records: &[&Record],
    now: u64,
    path: &str,
    csrf: &str,
) {
    if records.is_empty() {
        out.push_str("<p class=\"note\">None.</p>");
        return;
    }
    out.push_str(
        "<table><tr><th>operation</th><th>key</th><th>tenant</th><th>created</th>\
         <th>lease</th><th>attempt</th><th></th></tr>",
    );
    for record in records {
        let lease = if record.lease_expires_at_ms <= now {
            format!("lapsed {} ago", ago(now, record.lease_expires_at_ms))
        } else {
            format!("{} left", ago(record.lease_expires_at_ms, now))
        };
        let _ = write!(
            out,
            "<tr class=\"record\"><td>{}</td><td><code>{}</code></td><td><code>{}</code></td>\
             <td>{} ago</td><td>{}</td><td>{}</td><td>\
             <form class=\"release\" method=\"post\" action=\"{}/release\">\
             <input type=\"hidden\" name=\"scope\" value=\"{}\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <button type=\"submit\">Release</button></form></td></tr>",
            escape(&record.operation),
            escape(&record.key),
            escape(short(&record.tenant)),
            ago(now, record.created_at_ms),
            lease,
            record.generation,
            escape(path),
            record.scope.to_hex(),
            escape(csrf),
        );
    }
    out.push_str("</table>");
}

impl<S> Operator<S> {
    pub(super) fn render(&self, records: &[Record], csrf: &str, flash: Option<&str>) -> String {
        let now = idem_core::unix_ms();
        let path = &self.path;
        let mut out = String::new();
        let _ = write!(
            out,
            "<h1>idem operator</h1>\
             <form method=\"post\" action=\"{p}/sign-out\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{c}\">\
             <button type=\"submit\">Sign out</button></form>",
            p = escape(path),
            c = escape(csrf)
        );
        if let Some(flash) = flash {
            let _ = write!(out, "<p class=\"flash\" id=\"flash\">{}</p>", escape(flash));
        }
        states_table(&mut out, records);
        lease_tables(&mut out, records, now, path, csrf);
        tenants_table(&mut out, records);
        unknowns_table(&mut out, &self.unknowns.newest_first(), now);
        document("idem operator", &out)
    }
}

/// The states a table's columns show, in order.
const STATES: [RecordState; 4] = [
    RecordState::Processing,
    RecordState::Completed,
    RecordState::Cancelled,
    RecordState::Released,
];

/// The records by state, and a note when the listing was cut short.
fn states_table(out: &mut String, records: &[Record]) {
    let count = |state: RecordState| records.iter().filter(|r| r.state == state).count();
    out.push_str("<h2>Records by state</h2><table id=\"states\"><tr>");
    for state in STATES {
        let _ = write!(out, "<th>{}</th>", state.as_str());
    }
    out.push_str("</tr><tr>");
    for state in STATES {
        let _ = write!(out, "<td>{}</td>", count(state));
    }
    out.push_str("</tr></table>");
    if records.len() == LISTED {
        let _ = write!(
            out,
            "<p class=\"note\">Counted over the oldest {LISTED} live records.</p>"
        );
    }
}

/// The lapsed records (processing past their lease) and the oldest
/// processing ones, each with a release button.
fn lease_tables(out: &mut String, records: &[Record], now: u64, path: &str, csrf: &str) {
    let processing: Vec<&Record> = records
        .iter()
        .filter(|r| r.state == RecordState::Processing)
        .collect();
    let (lapsed, running): (Vec<&Record>, Vec<&Record>) = processing
        .into_iter()
        .partition(|r| r.lease_expires_at_ms <= now);
    out.push_str(
        "<h2 id=\"lapsed\">Lapsed records</h2>\
         <p class=\"note\">Processing past their lease, and no retry took them over: \
         release those whose owner is known to be gone (the next request runs).</p>",
    );
    record_table(out, &lapsed[..lapsed.len().min(50)], now, path, csrf);
    out.push_str("<h2 id=\"processing\">Oldest processing records</h2>");
    record_table(out, &running[..running.len().min(20)], now, path, csrf);
}

/// The records per tenant, by state, the busiest tenants first.
fn tenants_table(out: &mut String, records: &[Record]) {
    let mut tenants: Vec<(&str, [usize; 4])> = Vec::new();
    for record in records {
        let at = match tenants.iter().position(|(t, _)| *t == &*record.tenant) {
            Some(at) => at,
            None => {
                tenants.push((&record.tenant, [0; 4]));
                tenants.len() - 1
            }
        };
        let column = STATES.iter().position(|s| *s == record.state).unwrap_or(0);
        tenants[at].1[column] += 1;
    }
    tenants
        .sort_by_key(|(tenant, counts)| (std::cmp::Reverse(counts.iter().sum::<usize>()), *tenant));
    out.push_str("<h2>Records per tenant</h2>");
    if tenants.is_empty() {
        out.push_str("<p class=\"note\">None.</p>");
    } else {
        out.push_str("<table id=\"tenants\"><tr><th>tenant</th>");
        for state in STATES {
            let _ = write!(out, "<th>{}</th>", state.as_str());
        }
        out.push_str("</tr>");
        for (tenant, counts) in tenants.iter().take(50) {
            let _ = write!(out, "<tr><td><code>{}</code></td>", escape(short(tenant)));
            for n in counts {
                let _ = write!(out, "<td>{n}</td>");
            }
            out.push_str("</tr>");
        }
        out.push_str("</table>");
    }
}

/// The unknown outcomes this gateway saw last, newest first.
fn unknowns_table(out: &mut String, unknowns: &[super::Unknown], now: u64) {
    out.push_str(
        "<h2>Recent unknown outcomes</h2>\
         <p class=\"note\">The upstream did not answer in time, or its answer was lost: \
         the action may have run, so the key stays taken until a late answer is \
         recorded or its lease lapses.</p>",
    );
    if unknowns.is_empty() {
        out.push_str("<p class=\"note\">None since this gateway started.</p>");
    } else {
        out.push_str(
            "<table id=\"unknowns\"><tr><th>when</th><th>operation</th><th>scope</th>\
             <th>attempt</th><th>why</th></tr>",
        );
        for unknown in unknowns {
            let at = unknown
                .at
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            let _ = write!(
                out,
                "<tr><td>{} ago</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td></tr>",
                ago(now, at),
                escape(&unknown.operation),
                short(&unknown.scope.to_hex()),
                unknown.attempt,
                unknown.code
            );
        }
        out.push_str("</table>");
    }
}
