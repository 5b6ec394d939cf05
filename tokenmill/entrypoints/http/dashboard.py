"""The metrics port's app: Prometheus' `/metrics` and the live `/dashboard` page
(tokenmill/static/dashboard: HTML, its script and the vendored uPlot), which polls `/metrics`
from the browser. Its Content-Security-Policy allows the page's own origin only, so the page
cannot reach anything outside the server."""

from __future__ import annotations

import os

STATIC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "static",
                      "dashboard")
CSP = ("default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'")


def metrics_app(registry):
    from prometheus_client import make_asgi_app
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, RedirectResponse
    from starlette.routing import Mount, Route
    from starlette.staticfiles import StaticFiles

    headers = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache"}

    async def page(request):
        return FileResponse(os.path.join(STATIC, "index.html"), headers=headers)

    async def to_page(request):
        return RedirectResponse("/dashboard")

    class Files(StaticFiles):
        async def get_response(self, path, scope):
            response = await super().get_response(path, scope)
            response.headers.update(headers)
            return response

    return Starlette(routes=[Route("/dashboard", page), Route("/dashboard/", to_page),
                             Mount("/dashboard", Files(directory=STATIC)),
                             Mount("/", make_asgi_app(registry))])
