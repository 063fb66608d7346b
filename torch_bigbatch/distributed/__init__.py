"""torch_bigbatch.distributed: the "torus" c10d backend (registered on import) and its options."""

from .torus import (TorusOptions, create_torus_backend, parse_shape, register, resolve_shape,
                    save_torus_algorithm_table, torus_algorithm, torus_algorithm_table,
                    torus_allreduce_counts, torus_shape)

register()

__all__ = ["TorusOptions", "create_torus_backend", "parse_shape", "resolve_shape",
           "save_torus_algorithm_table", "torus_algorithm", "torus_algorithm_table",
           "torus_allreduce_counts", "torus_shape"]
