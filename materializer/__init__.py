"""Background materialization of changelog backends (FLIP-158's materializer)."""

from materializer.materializer import MaterializationStats, Materializer

__all__ = ["MaterializationStats", "Materializer"]
