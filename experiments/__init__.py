"""The study of the technical report (RQ1-RQ5): scripts, shared configs and committed results."""
