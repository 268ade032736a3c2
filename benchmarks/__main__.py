from benchmarks.specextend_bench import main

if __name__ == "__main__":
    main()
