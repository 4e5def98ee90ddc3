"""`ellm inspect`: the page (static/, shipped as package data) and its JSON API (app.py)."""
