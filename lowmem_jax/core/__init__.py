"""What every layer shares: the optimizer protocol and shared types (:mod:`.base`), the Technique
protocol (:mod:`.technique`, :mod:`.report_hooks`), the jaxpr walker, the device mesh, units and
paths. Imports nothing else of the library.
"""
