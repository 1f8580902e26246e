"""How the launcher reaches the router it started when that router serves HTTPS
(`--ssl-keyfile`, `--ssl-certfile`): the URL's scheme, and a TLS context that trusts the
router's own certificate.

The launcher calls its router over loopback (the readiness probe, the planner's admin routes),
where the certificate's names (a public host name) need not match the address dialled, so the
host name is not checked; the certificate itself is: the context trusts only the chain in
`--ssl-certfile` (its leaf accepted as an anchor, so a self-signed certificate or one issued by
a private CA both verify).
"""

from __future__ import annotations

import ssl

from pdserve.router.config import RouterConfig


def router_scheme(config: RouterConfig) -> str:
    return "https" if config.tls else "http"


def router_tls_context(config: RouterConfig) -> ssl.SSLContext | None:
    """The context to call the router with; None where it serves plain HTTP."""
    if not config.tls:
        return None
    return trusting_certificate(config.ssl_certfile)  # type: ignore[arg-type]


def trusting_certificate(certfile: str) -> ssl.SSLContext:
    """A client context that trusts the chain in `certfile` and checks no host name."""
    context = ssl.create_default_context(cafile=certfile)
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return context
