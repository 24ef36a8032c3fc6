"""Hosting plugins: the pluggy manager (plugin_manager), name-keyed registries (registry), the
components every plugin registered (components) and choosing the platform (platform_selection)."""
