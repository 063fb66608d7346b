"""torch_bigbatch.distributed: the "torus" c10d backend (registered on import) and its options."""

from .torus import (TorusOptions, auto_torus_max_bytes, create_torus_backend, parse_shape,
                    register, resolve_shape, torus_algorithm, torus_shape)

register()

__all__ = ["TorusOptions", "auto_torus_max_bytes", "create_torus_backend", "parse_shape",
           "resolve_shape", "torus_algorithm", "torus_shape"]
