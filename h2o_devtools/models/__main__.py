from h2o_devtools.models import main

main()
