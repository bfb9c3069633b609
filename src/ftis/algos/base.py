"""The algorithm protocol and what the node shell hands an algorithm: defined with the shell, in
ftis.train.context (the layer below the systems), and re-exported here for the systems and
for plugins that import it from ftis.algos.base."""

from ftis.train.context import Algorithm, NodeContext, ServiceContext

__all__ = ["Algorithm", "NodeContext", "ServiceContext"]
