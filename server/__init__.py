"""The coordinator: ServerApp, reply validation, checkpoints, run reports.

Import submodules directly (``fedge.server.app``); this package does not import
them eagerly, so strategies can use :mod:`fedge.strategies.validation` without
pulling in the whole app.
"""
