from neoembed.cli import main

main()
