"""The gateway's stages, one concern each (see ``llmesh.gateway.pipeline``): each a
``Stage`` (``stages.base``) that sees a request's ``Context`` and may refuse, rewrite or
annotate it, wrap the upstream, and observe the outcome. No stage imports another;
``app.py`` composes them in order."""
