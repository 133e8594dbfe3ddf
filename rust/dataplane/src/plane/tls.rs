//! The TLS set-up for `https://` workers: the system's roots plus the configured CA file.

use super::*;

/// The TLS set-up for `https://` workers: the system's roots plus `ca_file`'s certificates.
pub(super) fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, PlaneError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::CertificateDer;
    let mut roots = rustls::RootCertStore::empty();
    // Unreadable system certificates only matter for https workers, which then fail to connect (and say why).
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| PlaneError::Tls(format!("cannot read {}: {e}", path.display())))?
            .collect::<Result<_, _>>()
            .map_err(|e| PlaneError::Tls(format!("{}: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(PlaneError::Tls(format!("{} holds no PEM certificate", path.display())));
        }
        for cert in certs {
            roots.add(cert).map_err(|e| PlaneError::Tls(format!("{}: {e}", path.display())))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PlaneError::Tls(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(cfg)
}
