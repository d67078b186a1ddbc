"""The ``durable-streams`` command: ``serve`` (the gateway, alone or under
gunicorn, with an embedded Redis when no URL is given). Other commands, such as
the archive worker's ``archive``, register themselves through the
``durable_streams.commands`` entry point group, so the gateway never imports
them."""
