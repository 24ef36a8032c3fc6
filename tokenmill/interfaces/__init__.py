"""The contracts between tokenmill's core and its plugins.

Nothing here imports anything else from tokenmill: a plugin package can depend
on these modules alone.
"""
