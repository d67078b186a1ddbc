"""The command-line client's ``tenants`` command (docs/tenants.md): the tenants API under
``<url>/__ds/tenants``: list them, show one, change quotas."""

from __future__ import annotations

import argparse
import json
from typing import Any
from urllib.parse import quote

from ..protocol.namespace import RESERVED
from .client_http import OK, USAGE, Failure, stream_url
from .client_output import print_json
from .client_session import connect

TENANTS = f"{RESERVED}/tenants"


def parse_assignments(pairs: list[str]) -> dict[str, int | None]:
    """``quota=value`` arguments (``none`` or ``default``: back to the default), as the
    API's JSON merge patch; the server checks the names and values."""
    update: dict[str, int | None] = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise Failure(USAGE, f"--set {pair!r}: expected <quota>=<whole number | none>")
        if value.strip().lower() in ("none", "null", "default"):
            update[name.strip()] = None
        elif value.strip().isdigit():
            update[name.strip()] = int(value)
        else:
            raise Failure(USAGE, f"--set {pair!r}: {value!r} is not a whole number or 'none'")
    return update


def _line(found: dict[str, Any]) -> str:
    usage, quotas = found["usage"], found["quotas"]

    def of(name: str) -> str:
        limit = quotas.get(name)
        return f"{usage.get(name, 0)}/{'-' if limit is None else limit}"

    return (
        f"{found['tenant']:<24} streams {of('streams'):<14} stored {of('stored_bytes'):<24} "
        f"written {of('written_bytes'):<24} live {of('live_connections')}"
    )


async def tenants(args: argparse.Namespace) -> int:
    """No TENANT: the tenants, those storing the most first. TENANT: its quotas and usage,
    after ``--set`` changed them (``_defaults``: the defaults)."""
    async with connect(args) as client:
        base = stream_url(args.url, TENANTS)
        if args.tenant is None:
            if args.set or args.usage:
                raise Failure(USAGE, "--set and --usage need a TENANT")
            page = json.loads(
                (await client.call("GET", base, params={"limit": str(args.limit)}, ok=(200,))).body
            )
            for found in page["tenants"]:
                if args.json:
                    print_json(found)
                else:
                    print(_line(found))
            return OK
        url = f"{base}/{quote(args.tenant, safe='')}"
        if args.usage:
            params = {k: v for k, v in (("from", args.since), ("to", args.until)) if v}
            history = json.loads((await client.call("GET", f"{url}/usage", params=params, ok=(200,))).body)
            if args.json:
                print_json(history)
            for day in [] if args.json else history["days"]:
                counts = " ".join(f"{c}={n}" for c, n in sorted(day["usage"].items()))
                print(f"{day['day']}  {counts}")
            return OK
        if args.set:
            body = json.dumps(parse_assignments(args.set)).encode()
            headers = {"Content-Type": "application/merge-patch+json"}
            reply = await client.call("PATCH", f"{url}/quotas", data=body, headers=headers, ok=(200,))
        else:
            reply = await client.call("GET", url, ok=(200,))
        found = json.loads(reply.body)
        if args.json or args.tenant == "_defaults":
            print_json(found)
        else:
            print(_line(found))
    return OK
