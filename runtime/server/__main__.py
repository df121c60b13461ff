"""``python -m eaas.runtime.server ...`` = ``eaas expert-server ...`` (what the local launcher spawns)."""

from eaas.runtime.server.cli import expert_server

if __name__ == "__main__":
    expert_server()
