"""The small web apps the integration tests serve from real server processes (uvicorn,
Django's runserver), and the file-based overlap checker they share across processes."""
