"""The HTTP side: the aiohttp application, its handlers, live reads (long-poll
and SSE) and bounded request bodies. Handlers validate with ``protocol`` and
make one call on the Store (``gateway/streams``) per request."""
