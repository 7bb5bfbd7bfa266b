# Stubs for the parts of Mooncake (mooncake-transfer-engine[-non-cuda] 0.3.13) that pdkv uses.
# The package root re-exports buffer pools pdkv never touches; only the submodule matters.
