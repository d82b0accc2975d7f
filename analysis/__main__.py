from analysis.run import main

main()
