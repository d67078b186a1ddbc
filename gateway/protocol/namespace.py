"""The protocol's reserved path segment: ``{prefix}/__ds/`` holds the control APIs
(subscriptions, section 6) and this server's own (listing, console, statistics, JWKS);
no stream is named under it. Defined here once, for every layer."""

RESERVED = "__ds"
