"""TP x CP x DP meshes and the index arithmetic of vocabulary and token splits."""
