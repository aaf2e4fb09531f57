from .remat import RematProblem, RematResult, load_graph, simulate, solve_remat
