"""First-party plugins. Each module is one entry point in the ``tokenmill.plugins``
group, loaded exactly like a third-party package's."""
