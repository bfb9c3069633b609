"""The Flower App's components (pyproject.toml): FGRPO's deployed ServerApp and ClientApp
(`ftis.algos.fgrpo.deploy`), with this directory, the installed app bundle on every machine, as
the base of a relative `config` path."""

from pathlib import Path

from ftis.algos.fgrpo.deploy import deployed_client_app, deployed_server_app

APP_DIR = Path(__file__).resolve().parent

server_app = deployed_server_app(APP_DIR)
client_app = deployed_client_app(APP_DIR)
