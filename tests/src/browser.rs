//! A real headless Chromium, driven over WebDriver (`chromedriver`, plain
//! HTTP and JSON on loopback): pages load, forms are filled and buttons
//! clicked as a person would, cookies and all.

use std::{
    process::{Child, Command, Stdio},
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use serde_json::{Value, json};

use crate::{
    client,
    redis_server::{binary_available, free_port, skip_or_fail},
    send, wait_until,
};

/// The key under which WebDriver names an element.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A Chromium session; its driver (and the browser with it) is stopped on
/// drop, its profile removed.
#[derive(Debug)]
pub struct Browser {
    driver: Child,
    base: String,
    profile: std::path::PathBuf,
}

impl Browser {
    /// Starts `chromedriver` and a headless Chromium session; `None` (or,
    /// in CI, a failed test) where either is not installed.
    pub async fn start() -> Option<Self> {
        for binary in ["chromedriver", "chromium"] {
            if !binary_available(binary) {
                skip_or_fail(binary);
                return None;
            }
        }
        use std::os::unix::process::CommandExt;
        let port = free_port();
        // A process group of its own: stopping it stops the browser the
        // driver started too, whatever state the test left them in.
        let driver = Command::new("chromedriver")
            .process_group(0)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile =
            std::env::temp_dir().join(format!("idem-chromium-{port}-{}", std::process::id()));
        let mut browser = Self {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            profile,
        };
        let status = format!("{}/status", browser.base);
        let http = client();
        wait_until(
            Duration::from_secs(30),
            "chromedriver answers",
            async || {
                use http_body_util::BodyExt;
                let request = Request::get(&status)
                    .body(Full::new(Bytes::new()))
                    .expect("request");
                // Refused until the driver listens.
                let Ok(Ok(response)) =
                    tokio::time::timeout(Duration::from_secs(2), http.request(request)).await
                else {
                    return false;
                };
                let Ok(body) = response.into_body().collect().await else {
                    return false;
                };
                serde_json::from_slice::<Value>(&body.to_bytes())
                    .is_ok_and(|body| body["value"]["ready"] == true)
            },
        )
        .await;
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--window-size=1280,1000",
                    format!("--user-data-dir={}", browser.profile.display()),
                ],
            },
        }}});
        let session = browser.call(Method::POST, "/session", capabilities).await;
        let id = session["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {session}"))
            .to_owned();
        browser.base = format!("{}/session/{id}", browser.base);
        Some(browser)
    }

    /// One WebDriver command: its `value`; a WebDriver error fails the
    /// test.
    async fn call(&self, method: Method, path: &str, body: Value) -> Value {
        let body = if method == Method::GET || method == Method::DELETE {
            Bytes::new()
        } else {
            Bytes::from(body.to_string())
        };
        let request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(body))
            .expect("request");
        let reply = tokio::time::timeout(Duration::from_secs(60), send(&client(), request))
            .await
            .expect("chromedriver answers within a minute");
        let value: Value = serde_json::from_slice(&reply.body).unwrap_or_else(|error| {
            panic!("chromedriver answered no JSON ({error}): {:?}", reply.body)
        });
        assert!(
            reply.status.is_success(),
            "WebDriver {path}: {}",
            value["value"]
        );
        value["value"].clone()
    }

    /// Loads `url` and waits for it.
    pub async fn goto(&self, url: &str) {
        self.call(Method::POST, "/url", json!({ "url": url })).await;
    }

    /// The page's HTML as the browser holds it now.
    pub async fn source(&self) -> String {
        let value = self.call(Method::GET, "/source", Value::Null).await;
        value.as_str().unwrap_or_default().to_owned()
    }

    /// The page's HTML once it contains `text` (a click that submits a
    /// form may return before the next page has loaded); fails the test
    /// after 30 s, showing the page.
    pub async fn source_with(&self, text: &str) -> String {
        let found = crate::poll_until(
            Duration::from_secs(30),
            async || self.source().await,
            |source| source.contains(text),
        )
        .await;
        assert!(
            found.contains(text),
            "the page never showed {text:?}:\n{found}"
        );
        found
    }

    /// The current page's address.
    pub async fn url(&self) -> String {
        let value = self.call(Method::GET, "/url", Value::Null).await;
        value.as_str().unwrap_or_default().to_owned()
    }

    /// The first element `css` selects.
    async fn find(&self, css: &str) -> String {
        let found = self
            .call(
                Method::POST,
                "/element",
                json!({"using": "css selector", "value": css}),
            )
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_owned()
    }

    /// Types `text` into the element `css` selects.
    pub async fn type_into(&self, css: &str, text: &str) {
        let element = self.find(css).await;
        self.call(
            Method::POST,
            &format!("/element/{element}/value"),
            json!({ "text": text }),
        )
        .await;
    }

    /// Clicks the element `css` selects (a form's button submits it and
    /// the next page loads).
    pub async fn click(&self, css: &str) {
        let element = self.find(css).await;
        self.call(
            Method::POST,
            &format!("/element/{element}/click"),
            json!({}),
        )
        .await;
    }

    /// A PNG of the viewport.
    pub async fn screenshot(&self) -> Vec<u8> {
        use base64::Engine;
        let value = self.call(Method::GET, "/screenshot", Value::Null).await;
        base64::engine::general_purpose::STANDARD
            .decode(value.as_str().expect("base64"))
            .expect("a base64 PNG")
    }

    /// Ends the session (the browser quits), then the driver.
    pub async fn close(mut self) {
        let _ = tokio::time::timeout(
            Duration::from_secs(20),
            self.call(Method::DELETE, "", Value::Null),
        )
        .await;
        self.stop();
    }

    fn stop(&mut self) {
        // The whole group: the driver and every browser process under it.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.driver.id())])
            .status();
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.stop();
    }
}
