"""``python -m eaas.runtime.server ...`` = ``eaas expert-server ...`` (what the local launcher spawns)."""

from eaas.runtime.commands.expert_server import expert_server

if __name__ == "__main__":
    expert_server()
