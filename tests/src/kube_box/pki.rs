//! The box's throwaway PKI, made with the `openssl` CLI in the box's temp dir: a CA, the API
//! server's serving certificate (127.0.0.1 and localhost), and the service-account signing
//! key pair. Clients authenticate with a static admin token; the agent with a real
//! ServiceAccount token from the TokenRequest API, signed by that key.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// The files the control plane is started with.
#[derive(Clone, Debug)]
pub struct Pki {
    pub ca_pem: PathBuf,
    pub ca_key: PathBuf,
    pub server_pem: PathBuf,
    pub server_key: PathBuf,
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
}

impl Pki {
    /// Generates every file under `dir` (2-day validity: the box lives for one test run).
    pub fn generate(dir: &Path) -> anyhow::Result<Pki> {
        let p = |f: &str| dir.join(f);
        let s = |f: &str| p(f).to_string_lossy().into_owned();
        std::fs::write(
            p("server-ext.cnf"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes.default.svc\n\
             basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\n",
        )?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        let mut steps: Vec<Vec<String>> = Vec::new();
        let own = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        steps.push(own(&[
            &["req", "-x509"][..],
            &ec,
            &["-keyout", &s("ca.key"), "-out", &s("ca.pem")],
            &["-days", "2", "-subj", "/CN=lastcall box CA"],
        ]
        .concat()));
        steps.push(own(&[
            &["req"][..],
            &ec,
            &["-keyout", &s("server.key"), "-out", &s("server.csr")],
            &["-subj", "/CN=kube-apiserver"],
        ]
        .concat()));
        steps.push(own(&[
            "x509",
            "-req",
            "-in",
            &s("server.csr"),
            "-CA",
            &s("ca.pem"),
            "-CAkey",
            &s("ca.key"),
            "-CAcreateserial",
            "-out",
            &s("server.pem"),
            "-days",
            "2",
            "-extfile",
            &s("server-ext.cnf"),
        ]));
        steps.push(own(&["genrsa", "-out", &s("sa.key"), "2048"]));
        steps.push(own(&[
            "rsa",
            "-in",
            &s("sa.key"),
            "-pubout",
            "-out",
            &s("sa.pub"),
        ]));
        for args in steps {
            let out = Command::new("openssl")
                .args(&args)
                .stdin(Stdio::null())
                .output()
                .context("running openssl (apt-get install -y openssl)")?;
            if !out.status.success() {
                bail!(
                    "openssl {}: {}",
                    args.join(" "),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        Ok(Pki {
            ca_pem: p("ca.pem"),
            ca_key: p("ca.key"),
            server_pem: p("server.pem"),
            server_key: p("server.key"),
            sa_key: p("sa.key"),
            sa_pub: p("sa.pub"),
        })
    }
}
