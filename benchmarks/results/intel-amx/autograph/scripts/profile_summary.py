import pstats,sys
s=pstats.Stats(sys.argv[1])
st=s.stats
def cum(pred):
    best=0
    for (f,l,n),(cc,nc,tt,ct,callers) in st.items():
        if pred(f,n): best=max(best,ct)
    return best
print('total', round(s.total_tt,2))
for name,pred in [('import tensorflow',lambda f,n: f.endswith('tensorflow/__init__.py') and n=='<module>'),
 ('autograph converted_call', lambda f,n: 'autograph/impl/api.py' in f and n=='converted_call'),
 ('ag _convert_actual', lambda f,n: 'autograph/impl/api.py' in f and n=='_convert_actual'),
 ('transpiler transform', lambda f,n: 'pyct/transpiler.py' in f and n=='transform_function'),
 ('func_graph_from_py_func', lambda f,n: 'func_graph.py' in f and n=='func_graph_from_py_func'),
 ('tf.data StructuredFunctionWrapper', lambda f,n: 'structured_function.py' in f and n=='__init__'),
 ('polymorphic_function __call__', lambda f,n: 'polymorphic_function.py' in f and n=='__call__'),
 ('experiment.build', lambda f,n: 'experiment.py' in f and n=='build'),
 ('run', lambda f,n: 'experiment.py' in f and n=='run'),
 ]:
    print(name, round(cum(pred),2))
s.sort_stats('cumulative').print_stats(r'tfdp/', 25)
