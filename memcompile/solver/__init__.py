from .remat import RematProblem, RematResult, load_graph, simulate, solve_remat

__all__ = ["RematProblem", "RematResult", "load_graph", "simulate", "solve_remat"]
