from neoembed.cli import entry

entry()
