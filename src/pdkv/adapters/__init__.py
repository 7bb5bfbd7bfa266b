"""Scheduler backends: glue that lets a serving engine drive pdkv through that engine's own interfaces.

Owns: one subpackage per engine (``sglang``). These are the only modules that import a serving engine.
Must not be imported by ``pdkv`` itself (``import pdkv`` never loads an adapter; the import contract in
pyproject.toml keeps it so) and must not change pdkv's core behaviour: where an engine asks for something
pdkv cannot do, the adapter refuses it with a typed pdkv error.
"""
