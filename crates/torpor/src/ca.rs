//! `torpor ca init` / `torpor ca issue` / `torpor ca revoke`: the cluster's certificate authority (the logic is in
//! `torpor_cluster::ca`; this maps arguments onto it).

use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use torpor_cluster::ca::{Serial, CRL, DEFAULT_TRUST_DOMAIN};
use torpor_cluster::{Ca, MemberName, Role, TrustDomain};

use crate::common::CliError;

#[derive(Subcommand)]
pub enum CaCmd {
    /// Make a CA for a trust domain: DIR/ca.pem (give it to every member) and DIR/ca.key
    /// (keep it off the members' machines).
    Init {
        #[arg(long)]
        dir: PathBuf,
        /// The cluster's SPIFFE trust domain.
        #[arg(long, default_value = DEFAULT_TRUST_DOMAIN)]
        trust_domain: String,
        /// How long the CA is valid, e.g. 365d.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "365d")]
        ttl: Duration,
    },
    /// Issue a member's certificate (spiffe://<domain>/<role>/<name>): OUT/cert.pem,
    /// OUT/key.pem and OUT/ca.pem. Re-run it before expiry: running members re-read the files.
    Issue {
        /// The CA directory (`torpor ca init --dir`).
        #[arg(long)]
        dir: PathBuf,
        /// controller or worker.
        #[arg(long)]
        role: Role,
        #[arg(long)]
        name: String,
        #[arg(long)]
        out: PathBuf,
        /// How long the certificate is valid, e.g. 24h, 90m.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "24h")]
        ttl: Duration,
    },
    /// Revoke a member's certificate: recorded in DIR/revoked.json, and DIR/crl.pem (a CRL
    /// signed by the CA) rewritten. Copy DIR/crl.pem to every member's --tls-dir as crl.pem:
    /// running members re-read it and refuse the certificate from their next handshake on.
    Revoke {
        /// The CA directory (`torpor ca init --dir`).
        #[arg(long)]
        dir: PathBuf,
        /// The certificate to revoke (PEM, issued by this CA), e.g. OUT/cert.pem.
        #[arg(long, required_unless_present = "serial", conflicts_with = "serial")]
        cert: Option<PathBuf>,
        /// Or its serial number in hexadecimal (`openssl x509 -noout -serial`).
        #[arg(long)]
        serial: Option<String>,
    },
}

fn err(e: impl std::fmt::Display) -> CliError {
    CliError(e.to_string())
}

pub fn run(cmd: CaCmd) -> Result<i32, CliError> {
    match cmd {
        CaCmd::Init {
            dir,
            trust_domain,
            ttl,
        } => {
            let td = TrustDomain::new(&trust_domain).map_err(err)?;
            Ca::init(&dir, &td, ttl).map_err(err)?;
            println!("CA for {} in {}", td.uri(), dir.display());
        }
        CaCmd::Issue {
            dir,
            role,
            name,
            out,
            ttl,
        } => {
            let ca = Ca::load(&dir).map_err(err)?;
            let name = MemberName::new(&name).map_err(err)?;
            let issued = ca.issue(role, &name, ttl).map_err(err)?;
            issued.write_to(&out).map_err(err)?;
            println!(
                "{} until {} in {}",
                issued.identity,
                humantime::format_rfc3339_seconds(issued.not_after.into()),
                out.display()
            );
        }
        CaCmd::Revoke { dir, cert, serial } => {
            let ca = Ca::load(&dir).map_err(err)?;
            let done = match (cert, serial) {
                (Some(cert), _) => ca.revoke_certificate(&cert),
                (None, Some(serial)) => ca.revoke_serial(Serial::parse(&serial).map_err(err)?),
                (None, None) => return Err(err("give --cert FILE or --serial HEX")),
            }
            .map_err(err)?;
            let what = match &done.identity {
                Some(id) => format!("serial {} ({id})", done.serial),
                None => format!("serial {}", done.serial),
            };
            let verb = if done.newly {
                "revoked"
            } else {
                "already revoked"
            };
            println!(
                "{verb} {what}; {} (CRL #{}) lists {} certificate(s): copy it to every member's --tls-dir as {CRL}",
                done.crl_path.display(),
                done.crl_number,
                done.listed
            );
        }
    }
    Ok(0)
}
