"""``selfspec serve --ray``: the server as a Ray Serve application.

Modules: :mod:`~selfspec.cluster.options` (what the operator chooses),
:mod:`~selfspec.cluster.forward` (the HTTP request a replica answers, and the ASGI calls on
both sides), :mod:`~selfspec.cluster.serve_app` (the deployments and how they run).
"""
