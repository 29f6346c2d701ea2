//! TLS for the network tiers (Redis, S3): rustls over the `ring` provider, installed as the
//! process's default once, so that no system OpenSSL of any version is linked.

/// Makes `ring` the process's rustls provider unless one is installed already (by the
/// embedding application, whose choice then stands). Redis and reqwest build their TLS
/// configurations from the process default, so each network tier calls this before
/// connecting.
pub(crate) fn use_ring_for_tls() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
