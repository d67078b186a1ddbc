"""The Lua scripts, shipped as the package ``durable_streams_lua`` (pyproject.toml
maps this directory to that name); ``gateway/storage/scripts.py`` reads them
with importlib.resources."""
