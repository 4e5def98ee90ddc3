"""The API's routes, one module per route family. Each module's functions take the
Server (ellm.server.core) and a validated request; its register(app, server) adds its
routes to the FastAPI app (ellm.server.app.build_app calls them in order)."""
