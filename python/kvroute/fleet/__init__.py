"""The engines one Router routes over (``Fleet``): their table, their KV events and what their
/metrics say, shared by the gateway's control plane and the integrations' ``EngineRouter``."""

from kvroute.fleet.engine_metrics import CacheConfig, parse_cache_config, parse_engine_metrics
from kvroute.fleet.fleet import Engine, Fleet, check_prefix_cache_blocks

__all__ = ["CacheConfig", "Engine", "Fleet", "check_prefix_cache_blocks", "parse_cache_config", "parse_engine_metrics"]
