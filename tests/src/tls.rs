//! A private certificate authority for TLS tests: a CA and a server
//! certificate for `127.0.0.1` and `localhost`, made with `openssl` in a
//! temporary directory (removed on drop). A missing `openssl` fails in CI
//! and skips elsewhere.

use std::{path::PathBuf, process::Command};

use crate::redis_server::skip_or_fail;

/// The files of a test CA.
#[derive(Debug)]
pub struct TestCa {
    dir: PathBuf,
}

impl TestCa {
    /// Makes the CA and a server certificate; `None` without `openssl`
    /// (outside CI).
    pub fn new() -> Option<Self> {
        let found = Command::new("openssl")
            .arg("version")
            .output()
            .is_ok_and(|out| out.status.success());
        if !found {
            skip_or_fail("openssl");
            return None;
        }
        let dir = std::env::temp_dir().join(format!("idem-ca-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("dir");
        let ca = Self { dir };
        let run = |args: &[&str]| {
            let output = Command::new("openssl")
                .args(args)
                .current_dir(&ca.dir)
                .output()
                .expect("run openssl");
            assert!(
                output.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=idem test CA",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
        ]);
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
        ]);
        std::fs::write(
            ca.dir.join("san.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n",
        )
        .expect("san");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            "server.pem",
        ]);
        Some(ca)
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// The server certificate (PEM).
    pub fn cert(&self) -> PathBuf {
        self.dir.join("server.pem")
    }

    /// The server key (PEM).
    pub fn key(&self) -> PathBuf {
        self.dir.join("server.key")
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
