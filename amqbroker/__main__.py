from amqbroker.cli import main

main()
