"""Stored formats shared by several techniques: quantization maps, optimizer-state formats,
activation formats, leaf-group updates.
"""
