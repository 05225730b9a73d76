"""The web dashboard (OPS5): ``stepwarden dashboard``, an optional extra (``stepwarden[dashboard]``).

Starlette + Jinja2 templates + htmx (served from this package, no CDN). Pages for tasks, a task's
step timeline, alerts, leases and leader, workers and their breakers, throughput and backlog, all
refreshed live by polling small HTML fragments; ``/metrics`` for Prometheus. Operator actions
(retry, cancel, acknowledge) need the dashboard token and a same-origin, CSRF-checked request.

Nothing is imported here, so ``stepwarden.dashboard.command`` loads without the extra installed
and can say what to install. Build the ASGI app with :func:`stepwarden.dashboard.web.create_app`.
"""
