"""Drop-in integrations for the routers people already run: ``kvroute.integrations.litellm``
(``pip install 'kvroute[litellm]'``) and ``kvroute.integrations.ray_serve`` (``'kvroute[ray]'``).
Both sit on ``kvroute.integrations.engine_router.EngineRouter``; see docs/integrations.md."""
