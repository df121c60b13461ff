"""The ``eaas`` subcommands that run the runtime, one module each, listed in ``eaas.runtime.cli``.

This layer sits on top: a command imports the packages it launches (``server``, ``client``,
``serving``, ``local``) and the options the commands share (``options``); nothing below imports a
command.
"""
