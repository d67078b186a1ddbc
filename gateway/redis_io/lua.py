"""The Lua scripts' text: ``lua/`` ships as the package ``durable_streams_lua`` (mapped in
pyproject.toml), read with importlib.resources (the source tree in an editable install,
the wheel otherwise). Each script gets ``_prelude.lua`` put in front of it (and
``_subs.lua`` for the subscription scripts, ``_tenants.lua`` for those that store or free
a tenant's data), so shared helpers are written once.

Apart from scripts.py (which loads and calls them) so that what only needs a script's
text (layout.py's migration step) does not import the metrics: the command line
imports layout.py before `serve --workers N` sets PROMETHEUS_MULTIPROC_DIR.
"""

from __future__ import annotations

from importlib import resources

PACKAGE = "durable_streams_lua"
_CLUSTER_MARK = "local CLUSTER = false --[[cluster]]"
# The scripts that store or free data for a tenant get ``_tenants.lua`` after the prelude.
TENANT_SCRIPTS = frozenset(
    {
        "create",
        "append",
        "append_part",
        "delete",
        "tenant_sweep",
        "archive_retain",
        "compact",
        "archive_replace",
    }
)


def source(name: str, cluster: bool = False) -> str:
    """A script's text as Redis gets it: the prelude, then the script. ``cluster``:
    notices go out with sharded pub/sub where the server has it (``publish``)."""
    folder = resources.files(PACKAGE)
    prelude = (folder / "_prelude.lua").read_text()
    if cluster:
        prelude = prelude.replace(_CLUSTER_MARK, "local CLUSTER = true")
    if name.startswith("sub_"):
        prelude += "\n" + (folder / "_subs.lua").read_text()
    if name in TENANT_SCRIPTS:
        prelude += "\n" + (folder / "_tenants.lua").read_text()
    return prelude + "\n" + (folder / f"{name}.lua").read_text()
